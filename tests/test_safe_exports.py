"""Export folders from someone else (issue 47): data only, checked against their manifest before use, written
atomically, sources recorded safely. Each case is what a hostile or careless folder did to the releases before
export format 3 (a file written by a TorchScript archive, NaN logits from a flipped byte, a silent position guard
lifted by an edited config.json, a half-written save, an --overwrite that deleted a user's files)."""

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Tuple

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import write_legacy_export
from optimum_ipex_spec import IPEXModelForCausalLM
from optimum_ipex_spec.loading.export_folder import read_export_meta
from optimum_ipex_spec.cli.export import ExportError, main_export
from optimum_ipex_spec.loading.manifest import ManifestError, write_manifest

BACKENDS = ("torch", "auto")  # "auto": IPEX's graphs in the IPEX lane, our decoder in the lane without IPEX


class _Trojan(torch.nn.Module):
    """A TorchScript module that creates and writes a file when it is loaded (``__setstate__``) and when it runs: what
    a crafted ``ipex_model.pt`` can do (``torch.from_file(shared=True)`` maps a path for writing)."""

    def __init__(self, path: str):
        super().__init__()
        self.path = path
        self.written = 0  # kept, so that the compiler keeps the writes

    @torch.jit.export
    def __getstate__(self) -> Tuple[str, bool]:
        return self.path, self.training

    @torch.jit.export
    def __setstate__(self, state: Tuple[str, bool]) -> None:
        self.path = state[0]
        self.training = state[1]
        self.written = int(torch.from_file(self.path, shared=True, size=6, dtype=torch.uint8).fill_(33).sum())

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        self.written = int(torch.from_file(self.path, shared=True, size=6, dtype=torch.uint8).fill_(34).sum())
        return input_ids


class _TrojanPair(torch.nn.Module):
    def __init__(self, path: str):
        super().__init__()
        self.decode = _Trojan(path)
        self.verify = _Trojan(path)


def _write_trojan(path: Path, victim: Path) -> None:
    victim.touch()  # scripting needs no file; saving runs __getstate__ only
    torch.jit.save(torch.jit.script(_TrojanPair(str(victim))), str(path))
    victim.unlink()


@pytest.fixture
def tiny_export(tiny_dir, tmp_path):
    """A saved pure-PyTorch export of the tiny Llama (both lanes) and its greedy tokens from stock transformers."""
    def make(backend="torch", name="export"):
        folder = tmp_path / name
        IPEXModelForCausalLM.from_pretrained(tiny_dir("llama"), export=True, backend=backend).save_pretrained(folder)
        return folder
    return make


def _greedy(model, n=12):
    ids = torch.tensor([[1, 5, 9, 200, 17, 4, 77, 31]])
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)


def _rewrite_meta(folder: Path, **changes) -> None:
    meta = json.loads((folder / "ipex_export.json").read_text())
    meta.update(changes)
    (folder / "ipex_export.json").write_text(json.dumps(meta))


# ----------------------------------------------------------------------------- the folder is data
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_saved_export_is_data_and_gives_stock_tokens(backend, tiny_dir, tiny_export):
    folder = tiny_export(backend)
    names = sorted(os.listdir(folder))
    assert names == ["config.json", "generation_config.json", "ipex_export.json", "manifest.json", "model.safetensors"]
    manifest = json.loads((folder / "manifest.json").read_text())
    assert sorted(manifest["files"]) == [n for n in names if n != "manifest.json"]
    for name, info in manifest["files"].items():
        assert info["size"] == (folder / name).stat().st_size and len(info["sha256"]) == 64
    meta = read_export_meta(str(folder), "export")
    assert meta["format_version"] == 3 and meta["facts"]["max_position_embeddings"] == 4096
    loaded = IPEXModelForCausalLM.from_pretrained(folder)
    assert loaded.backend == meta["backend"] and loaded.source == str(folder)
    stock = AutoModelForCausalLM.from_pretrained(tiny_dir("llama")).eval()
    assert torch.equal(_greedy(loaded), _greedy(stock))


def test_the_trojan_archive_writes_nothing_unless_trusted(ipex_available, tiny_dir, tmp_path):
    """A format-2 folder whose ipex_model.pt writes a file when loaded or run: refused, nothing written; with
    trust_torchscript=True it is loaded (and writes: the opt-in means running the folder's program)."""
    model = IPEXModelForCausalLM.from_pretrained(tiny_dir("llama"), export=True, backend="ipex")
    folder, victim = tmp_path / "shared-by-someone", tmp_path / "victim.txt"
    write_legacy_export(model, folder)
    _write_trojan(folder / "ipex_model.pt", victim)
    with pytest.raises(ValueError, match="TorchScript program, and loading it runs code"):
        IPEXModelForCausalLM.from_pretrained(folder)
    assert not victim.exists()
    with pytest.raises(Exception):
        IPEXModelForCausalLM.from_pretrained(folder, trust_torchscript=True)  # not a real graph: fails once loaded
    assert victim.read_bytes()[:1] in (b"!", b"\"")  # the archive ran: the test's trojan is real


@pytest.mark.parametrize("listed", [False, True])
def test_a_program_dropped_into_a_data_only_folder_is_refused(listed, tiny_export, tmp_path):
    folder, victim = tiny_export(), tmp_path / "victim.txt"
    _write_trojan(folder / "ipex_model.pt", victim)
    if listed:  # a manifest rewritten to list it: refused all the same
        write_manifest(str(folder))
    with pytest.raises(ManifestError, match=r"ipex_model.pt is a program or pickle file"):
        IPEXModelForCausalLM.from_pretrained(folder)
    (folder / "ipex_model.pt").unlink()
    torch.save({"x": 1}, folder / "pytorch_model.bin")
    with pytest.raises(ManifestError, match="pytorch_model.bin is a program or pickle"):
        IPEXModelForCausalLM.from_pretrained(folder)
    assert not victim.exists()


def test_unlisted_files_loading_could_read_are_refused_and_others_ignored(tiny_export):
    folder = tiny_export()
    for name in ("README.md", ".gitattributes", "tokenizer.json", "tokenizer_config.json", "merges.txt"):
        (folder / name).write_text("{}")
    (folder / "notes").mkdir()
    IPEXModelForCausalLM.from_pretrained(folder)  # a tokenizer saved beside it, hub files, a subfolder
    (folder / "extra_config.json").write_text("{}")
    with pytest.raises(ManifestError, match="extra_config.json is not in the folder's manifest"):
        IPEXModelForCausalLM.from_pretrained(folder)
    (folder / "extra_config.json").unlink()
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "base_model_name_or_path": "x/y"}))
    for listed in (False, True):
        if listed:
            write_manifest(str(folder))
        with pytest.raises(ManifestError, match="adapter_config.json would make transformers load another model"):
            IPEXModelForCausalLM.from_pretrained(folder)


def _shard(folder: Path, shard_name: str, tmp_path: Path) -> None:
    """Turn the export's weights into a sharded checkpoint whose index names ``shard_name`` (the real weights moved
    there, when it is a place a file can be written)."""
    weights = folder / "model.safetensors"
    from safetensors.torch import load_file

    keys = list(load_file(weights))
    target = Path(shard_name) if os.path.isabs(shard_name) else folder / shard_name
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(weights, target)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {
        key: shard_name for key in keys}}))
    write_manifest(str(folder))  # an attacker writes a manifest to match


@pytest.mark.parametrize("shard_name", ["sub/weights.bin", "weights.data", "ABSOLUTE", "../outside.safetensors"])
def test_a_sharded_index_may_name_only_safetensors_files_of_the_folder(shard_name, tiny_export, tmp_path,
                                                                        monkeypatch):
    """transformers joins each shard name onto the folder and torch.load()s any suffix but .safetensors: an index
    naming a pickle, a subfolder's file or a path outside is refused before anything is read."""
    folder = tiny_export()
    if shard_name == "ABSOLUTE":
        shard_name = str(tmp_path / "elsewhere.safetensors")
    _shard(folder, shard_name, tmp_path)
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("torch.load ran on a file of the folder"))
    with pytest.raises(ValueError, match="model.safetensors.index.json names the weight file .*not a .safetensors "
                                         "file of the folder"):
        IPEXModelForCausalLM.from_pretrained(folder)


def test_a_sharded_export_of_plain_shards_loads(tiny_export, tiny_dir, tmp_path):
    folder = tiny_export()
    _shard(folder, "model-00001-of-00001.safetensors", tmp_path)
    stock = AutoModelForCausalLM.from_pretrained(tiny_dir("llama")).eval()
    assert torch.equal(_greedy(IPEXModelForCausalLM.from_pretrained(folder)), _greedy(stock))


def test_remote_code_in_an_export_config_is_refused(tiny_export):
    folder = tiny_export()
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "auto_map": {"AutoConfig": "evil/repo--mod.Cls"}}))
    write_manifest(str(folder))
    for trust in (False, True):
        with pytest.raises(ValueError, match=r"config.json names remote code \(auto_map\)"):
            IPEXModelForCausalLM.from_pretrained(folder, trust_remote_code=trust)


def test_a_folder_claiming_an_old_format_gets_no_source_and_its_manifest_checked(tiny_export, tmp_path):
    """A folder that claims format 2 (pure-PyTorch: safetensors, no manifest) loads with a warning, reads its weights
    from itself (self_draft() too), never from the source it records; a manifest it holds is checked all the same."""
    folder = tiny_export()
    _rewrite_meta(folder, format_version=2, source="someone/else-model", source_options={"revision": "evil"})
    with pytest.raises(ManifestError, match="ipex_export.json (has|does not match)"):
        IPEXModelForCausalLM.from_pretrained(folder)
    (folder / "manifest.json").unlink()
    loaded = IPEXModelForCausalLM.from_pretrained(folder)
    assert loaded.source == str(folder) and loaded.source_options == {}
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "base_model_name_or_path": "x/y"}))
    with pytest.raises(ManifestError, match="adapter_config.json would make transformers load another model"):
        IPEXModelForCausalLM.from_pretrained(folder)
    (folder / "adapter_config.json").unlink()
    (folder / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(ManifestError, match="pytorch_model.bin is a program or pickle file"):
        IPEXModelForCausalLM.from_pretrained(folder)
    (folder / "pytorch_model.bin").unlink()
    write_manifest(str(folder))  # a manifest in a folder claiming format 2: its weights' sha256 is checked too
    data = bytearray((folder / "model.safetensors").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (folder / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(ManifestError, match="model.safetensors does not match the sha256"):
        IPEXModelForCausalLM.from_pretrained(folder)


def test_pickled_weights_are_never_loaded(tiny_dir, tmp_path, monkeypatch):
    """A checkpoint folder whose weights are pytorch_model.bin only: refused with the conversion to run, nothing
    unpickled (transformers would torch.load it, weights_only or not)."""
    from conftest import build_tiny

    model = build_tiny("llama")
    model.config.save_pretrained(tmp_path / "pickled")  # transformers 5 writes no .bin any more: as 4.x did
    torch.save(model.state_dict(), tmp_path / "pickled" / "pytorch_model.bin")
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("torch.load ran on a file of the folder"))
    for export in (True, False):
        with pytest.raises(ValueError, match=r"holds its weights only as pickles \(pytorch_model.bin\).*"
                                             r"safe_serialization=True"):
            IPEXModelForCausalLM.from_pretrained(tmp_path / "pickled", export=export)


def test_a_local_folder_with_an_at_sign_is_refused_not_looked_up_elsewhere(tiny_export, tmp_path):
    folder = tiny_export()
    shutil.copytree(folder, tmp_path / "model@v1")
    with pytest.raises(ValueError, match="optimum reads 'name@revision' as a hub id"):
        IPEXModelForCausalLM.from_pretrained(tmp_path / "model@v1")


def test_missing_facts_a_quantization_config_and_a_damaged_header_are_named(tiny_export):
    folder = tiny_export()
    meta = json.loads((folder / "ipex_export.json").read_text())
    _rewrite_meta(folder, facts={})
    write_manifest(str(folder))
    with pytest.raises(ValueError, match="does not record vocab_size"):
        IPEXModelForCausalLM.from_pretrained(folder)
    _rewrite_meta(folder, facts=meta["facts"])
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "bitnet"}}))
    write_manifest(str(folder))
    with pytest.raises(ValueError, match="declares a quantization_config"):
        IPEXModelForCausalLM.from_pretrained(folder)
    (folder / "config.json").write_text(json.dumps(config))
    write_manifest(str(folder))
    weights = folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[9] = ord("[")  # the header's opening brace: the parser fails before the digest is compared
    weights.write_bytes(bytes(data))
    with pytest.raises(ManifestError, match="model.safetensors does not match the sha256"):
        IPEXModelForCausalLM.from_pretrained(folder)


def test_a_pure_pytorch_export_of_format_2_drafts_from_its_own_folder(tiny_export, tiny_dir):
    folder = tiny_export()
    _rewrite_meta(folder, format_version=2)
    (folder / "manifest.json").unlink()
    loaded = IPEXModelForCausalLM.from_pretrained(folder)
    draft = loaded.self_draft(torch_dtype=torch.bfloat16, backend="torch")
    stock = AutoModelForCausalLM.from_pretrained(tiny_dir("llama")).eval()
    ids = torch.tensor([[1, 5, 9, 200, 17, 4, 77, 31]])
    got = loaded.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                          assistant_model=draft)
    assert torch.equal(got, _greedy(stock))


def test_cli_overwrite_keeps_the_users_files_or_refuses(tiny_dir, tmp_path):
    out = tmp_path / "out"
    main_export(tiny_dir("llama"), str(out), backend="torch")
    (out / "NOTES.md").write_text("mine")
    (out / "results").mkdir()
    (out / "results" / "run.csv").write_text("mine")
    main_export(tiny_dir("llama"), str(out), backend="torch", overwrite=True)
    assert (out / "NOTES.md").read_text() == "mine" and (out / "results" / "run.csv").read_text() == "mine"
    (out / "my_eval.json").write_text("{}")
    with pytest.raises(ExportError, match=r"holds an export and files of yours \(my_eval.json\)"):
        main_export(tiny_dir("llama"), str(out), backend="torch", overwrite=True)
    assert (out / "my_eval.json").read_text() == "{}"


def test_a_subfolder_that_links_out_is_refused(tiny_dir, tmp_path):
    (tmp_path / "repo").mkdir()
    os.symlink(tiny_dir("llama"), tmp_path / "repo" / "base")
    with pytest.raises(ValueError, match="leads out of the model folder"):
        IPEXModelForCausalLM.from_pretrained(str(tmp_path / "repo"), subfolder="base", export=True)


# ----------------------------------------------------------------------------- damage goes noticed
def test_a_flipped_byte_or_a_truncated_file_is_named(tiny_export):
    folder = tiny_export()
    weights = folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 4096] = b"\xff" * 4096
    weights.write_bytes(bytes(data))
    with pytest.raises(ManifestError, match=r"model.safetensors does not match the sha256 in its manifest"):
        IPEXModelForCausalLM.from_pretrained(folder)
    config = folder / "config.json"
    config.write_text(config.read_text()[:-10])
    with pytest.raises(ManifestError, match=r"config.json has \d+ bytes, its manifest says \d+"):
        IPEXModelForCausalLM.from_pretrained(folder)


def test_edited_facts_are_refused_even_with_a_matching_manifest(tiny_export):
    """The position guard, dtype and vocabulary come from what the export recorded: a config.json or
    ipex_export.json edited after the save is refused, also when the manifest was rewritten to match."""
    folder = tiny_export()
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 10 ** 9}))
    with pytest.raises(ManifestError, match=r"config.json (has \d+ bytes, its manifest says|does not match the sha)"):
        IPEXModelForCausalLM.from_pretrained(folder)
    write_manifest(str(folder))
    with pytest.raises(ValueError, match=r"max_position_embeddings=1000000000, but the export was built with 4096"):
        IPEXModelForCausalLM.from_pretrained(folder)
    (folder / "config.json").write_text(json.dumps(config))
    _rewrite_meta(folder, torch_dtype="bfloat16")
    write_manifest(str(folder))
    with pytest.raises(ValueError, match=r"is F32, but the export recorded torch_dtype 'bfloat16'"):
        IPEXModelForCausalLM.from_pretrained(folder)
    _rewrite_meta(folder, torch_dtype="float32", architecture="MistralForCausalLM")
    write_manifest(str(folder))
    with pytest.raises(ValueError, match="names architecture 'LlamaForCausalLM', the export recorded 'Mistral"):
        IPEXModelForCausalLM.from_pretrained(folder)


def test_a_link_out_of_the_folder_is_refused(tiny_export, tmp_path):
    folder = tiny_export()
    outside = tmp_path / "elsewhere.safetensors"
    shutil.move(folder / "model.safetensors", outside)
    os.symlink(outside, folder / "model.safetensors")  # the same bytes, outside the folder
    with pytest.raises(ManifestError, match=r"model.safetensors is a link to .*elsewhere.safetensors, outside"):
        IPEXModelForCausalLM.from_pretrained(folder)


def test_a_folder_without_manifest_or_with_a_bad_one_is_refused(tiny_export):
    folder = tiny_export()
    (folder / "manifest.json").write_text(json.dumps({"manifest_version": 1, "files": {"../config.json": {
        "size": 1, "sha256": "0" * 64}}}))
    with pytest.raises(ManifestError, match="does not list plain file names"):
        IPEXModelForCausalLM.from_pretrained(folder)
    (folder / "manifest.json").unlink()
    with pytest.raises(ManifestError, match="has no manifest.json: it is not a complete export"):
        IPEXModelForCausalLM.from_pretrained(folder)


# ----------------------------------------------------------------------------- atomic writes
_KILLED_SAVE = """
import os, signal, sys
from optimum_ipex_spec import IPEXModelForCausalLM
import optimum_ipex_spec.modeling as modeling
model = IPEXModelForCausalLM.from_pretrained(sys.argv[1], export=True, backend="torch", torch_dtype=sys.argv[3])
modeling.write_manifest = lambda folder: os.kill(os.getpid(), signal.SIGKILL)  # killed with the weights written
model.save_pretrained(sys.argv[2])
"""


def _killed_save(source: str, target: Path, dtype: str) -> None:
    result = subprocess.run([sys.executable, "-c", _KILLED_SAVE, source, str(target), dtype], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == -signal.SIGKILL, result.stderr


def test_a_killed_save_leaves_the_old_export_or_nothing(tiny_dir, tiny_export, tmp_path):
    folder = tiny_export()
    before = {name: (folder / name).read_bytes() for name in os.listdir(folder)}
    _killed_save(tiny_dir("llama"), folder, "bfloat16")  # over an existing export
    assert {name: (folder / name).read_bytes() for name in os.listdir(folder)} == before
    assert IPEXModelForCausalLM.from_pretrained(folder).dtype == torch.float32
    leftovers = [p for p in tmp_path.iterdir() if p.name.startswith(".export-")]
    assert len(leftovers) == 1 and (leftovers[0] / "model.safetensors").is_file()
    with pytest.raises(ManifestError, match="has no manifest.json: it is not a complete export"):
        IPEXModelForCausalLM.from_pretrained(leftovers[0])
    _killed_save(tiny_dir("llama"), tmp_path / "new", "float32")  # into a new folder
    assert not (tmp_path / "new").exists()


def test_save_pretrained_replaces_only_an_export_or_an_empty_folder(tiny_dir, tmp_path, monkeypatch):
    model = IPEXModelForCausalLM.from_pretrained(tiny_dir("llama"), export=True, backend="torch")
    project = tmp_path / "project"
    project.mkdir()
    (project / "train.py").write_text("print('mine')")
    with pytest.raises(ValueError, match=r"holds files that are not part of an export \(train.py\)"):
        model.save_pretrained(project)
    model.save_pretrained(tmp_path / "mine")
    (tmp_path / "mine" / "my_eval.json").write_text("{}")  # the user's file inside an export: not deleted either
    with pytest.raises(ValueError, match=r"not part of an export \(my_eval.json\)"):
        model.save_pretrained(tmp_path / "mine")
    shutil.rmtree(tmp_path / "mine")
    monkeypatch.chdir(project)
    for here in (".", ".."):
        with pytest.raises(ValueError, match="is the working directory, one of its parents"):
            model.save_pretrained(here)
    assert os.listdir(project) == ["train.py"]
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        model.save_pretrained(tmp_path / "a-file")
    os.symlink(project, tmp_path / "link")
    with pytest.raises(ValueError, match="is a symbolic link"):
        model.save_pretrained(tmp_path / "link")
    with pytest.raises(ValueError, match="holds files that are not part of an export"):
        model.save_pretrained(tiny_dir("llama"))  # the checkpoint it was exported from is not replaced
    (tmp_path / "models" / "a").mkdir(parents=True)
    with pytest.raises(ValueError, match=r"not part of an export \(a\)"):
        model.save_pretrained(tmp_path / "models")  # nor a folder of folders
    (tmp_path / "empty").mkdir()
    model.save_pretrained(tmp_path / "empty")
    model.save_pretrained(tmp_path / "empty")  # over its own export
    assert (tmp_path / "empty" / "manifest.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "empty", "link", "models", "project"]


def test_save_keeps_the_tokenizer_readme_and_draft_beside_the_export(tiny_dir, tmp_path, tokenizer):
    """transformers' habit: the tokenizer saved first (or after) into the same folder, a README, the CLI's
    draft-bf16/ export; a save over the folder keeps them (its manifest lists them), and still loads."""
    folder = tmp_path / "export"
    tokenizer.save_pretrained(folder)  # the tokenizer first
    model = IPEXModelForCausalLM.from_pretrained(tiny_dir("llama"), export=True, backend="torch")
    model.save_pretrained(folder)
    (folder / "README.md").write_text("# my model")
    model.self_draft(torch_dtype=torch.bfloat16, backend="torch").save_pretrained(folder / "draft-bf16")
    before = sorted(os.listdir(folder))
    IPEXModelForCausalLM.from_pretrained(folder).save_pretrained(folder)  # over itself
    assert sorted(os.listdir(folder)) == before and "tokenizer_config.json" in before
    assert "README.md" in json.loads((folder / "manifest.json").read_text())["files"]
    loaded = IPEXModelForCausalLM.from_pretrained(folder)
    draft = IPEXModelForCausalLM.from_pretrained(folder / "draft-bf16")
    assert loaded.origin == draft.origin == (tiny_dir("llama"), {})
    stock = AutoModelForCausalLM.from_pretrained(tiny_dir("llama")).eval()
    assert torch.equal(_greedy(loaded), _greedy(stock))
    ids = torch.tensor([[1, 5, 9, 200, 17, 4, 77, 31]])
    got = loaded.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                          assistant_model=draft)
    assert torch.equal(got, _greedy(stock)) and draft.last_speculation_stats.shared_rows > 0


@pytest.mark.parametrize("where, message", [
    ("cwd", "is the working directory"), ("parent", "is the working directory, one of its parents"),
    ("home", "the home folder"), ("symlink", "is a symbolic link"), ("user-folder", "holds no export of ours")])
def test_cli_overwrite_refuses_folders_that_are_not_exports(where, message, tiny_dir, tmp_path, monkeypatch):
    work = tmp_path / "work" / "project"
    work.mkdir(parents=True)
    (work / "mine.txt").write_text("user data")
    other = tmp_path / "other"
    other.mkdir()
    (other / "mine.txt").write_text("user data")
    monkeypatch.chdir(work)
    home = tmp_path / "home"
    home.mkdir()
    (home / "mine.txt").write_text("user data")
    monkeypatch.setenv("HOME", str(home))
    output = {"cwd": ".", "parent": "..", "home": "~", "symlink": str(tmp_path / "link"),
              "user-folder": str(other)}[where]
    if where == "symlink":
        os.symlink(other, tmp_path / "link")
    with pytest.raises(ExportError, match=message):
        main_export(tiny_dir("llama"), output, overwrite=True, backend="torch")
    for folder in (work, other, home):
        assert (folder / "mine.txt").read_text() == "user data"


# ----------------------------------------------------------------------------- sources
def test_a_relative_source_is_recorded_absolute_and_subfolders_stay_inside(tiny_dir, tmp_path, monkeypatch):
    shutil.copytree(tiny_dir("llama"), tmp_path / "tiny_target")
    monkeypatch.chdir(tmp_path)
    model = IPEXModelForCausalLM.from_pretrained("./tiny_target", export=True, backend="torch")
    assert model.source == str(tmp_path / "tiny_target")
    model.save_pretrained("saved")
    assert read_export_meta(str(tmp_path / "saved"), "saved")["source"] == str(tmp_path / "tiny_target")
    for subfolder in ("../x", "/etc", "a/../../x"):
        with pytest.raises(ValueError, match="leads out of the model folder"):
            IPEXModelForCausalLM.from_pretrained(str(tmp_path / "tiny_target"), subfolder=subfolder, export=True)
    _rewrite_meta(tmp_path / "saved", source_options={"subfolder": "../x"})
    write_manifest(str(tmp_path / "saved"))
    with pytest.raises(ValueError, match="source_options: subfolder='../x' leads out"):
        IPEXModelForCausalLM.from_pretrained(tmp_path / "saved")


@pytest.mark.usefixtures("ipex_available")
def test_an_ipex_export_loads_on_our_decoder_where_ipex_is_unusable(tiny_dir, tiny_export, monkeypatch, caplog):
    """The folder holds weights, not IPEX's graphs: where IPEX cannot run, backend='auto' loads it on our decoder
    (logged once), with stock transformers' tokens."""
    import logging

    from optimum_ipex_spec.utils import import_utils
    from optimum_ipex_spec.utils.import_utils import IPEXStatus
    import optimum_ipex_spec.modeling as modeling

    folder = tiny_export("ipex")
    fake = IPEXStatus(False, "2.7.0", torch.__version__, "intel_extension_for_pytorch 2.7.0 needs torch 2.7.*")
    monkeypatch.setattr(import_utils, "ipex_status", lambda: fake)
    monkeypatch.setattr(modeling, "ipex_status", lambda: fake)
    import_utils.log_fallback_once.cache_clear()
    with caplog.at_level(logging.WARNING, logger="optimum_ipex_spec"):
        loaded = IPEXModelForCausalLM.from_pretrained(folder)
    import_utils.log_fallback_once.cache_clear()
    assert loaded.backend == "torch" and "needs torch 2.7" in caplog.text
    stock = AutoModelForCausalLM.from_pretrained(tiny_dir("llama")).eval()
    assert torch.equal(_greedy(loaded), _greedy(stock))


def test_a_file_verified_before_is_not_hashed_again_until_it_changes(tiny_export, tmp_path, monkeypatch):
    """The second load of an unchanged folder skips the sha256 pass (this machine's record of the verified file);
    a change to the file, even with its size kept, is hashed again and refused."""
    from optimum_ipex_spec.loading import manifest

    monkeypatch.setenv("OPTIMUM_IPEX_SPEC_CACHE", str(tmp_path / "cache"))
    folder = tiny_export()
    monkeypatch.setattr(manifest, "SETTLED_NS", 0)  # the files were written a moment ago
    hashed = []
    digest = manifest.digest_of_unchanged_file
    monkeypatch.setattr(manifest, "digest_of_unchanged_file",
                        lambda path: hashed.append(os.path.basename(path)) or digest(path))
    IPEXModelForCausalLM.from_pretrained(folder)
    assert "model.safetensors" in hashed and os.listdir(tmp_path / "cache" / "_verified")
    hashed.clear()
    IPEXModelForCausalLM.from_pretrained(folder)
    assert hashed == []
    weights = folder / "model.safetensors"
    data, stat = bytearray(weights.read_bytes()), weights.stat()
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # the old modification time back: ctime still moves
    with pytest.raises(ManifestError, match="model.safetensors does not match the sha256"):
        IPEXModelForCausalLM.from_pretrained(folder)
    assert "model.safetensors" in hashed
