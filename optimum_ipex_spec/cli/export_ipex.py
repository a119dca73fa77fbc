"""``optimum-cli export ipex``: export a causal LM with IPEX, save it, validate the saved folder.

Nothing heavy is imported at module level: ``optimum-cli --help`` imports this module.
"""

from __future__ import annotations

import sys
from argparse import ArgumentParser

from optimum.commands.base import BaseOptimumCLICommand, CommandInfo

from ..facts import BACKENDS, EXPORT_DTYPES, TASKS

DTYPES = EXPORT_DTYPES + ("auto",)


def parse_args_ipex(parser: ArgumentParser) -> None:
    required = parser.add_argument_group("Required arguments")
    required.add_argument("-m", "--model", required=True,
                          help="Model folder, hub model id, or a name known to "
                               "optimum_ipex_spec.provisioning.provision (e.g. smollm2-135m-instruct).")
    required.add_argument("output", help="Folder to write the export to (absent, empty, or an export with "
                                         "--overwrite).")
    optional = parser.add_argument_group("Optional arguments")
    optional.add_argument("--task", default="auto", choices=("auto",) + TASKS,
                          help="Task to export for; inferred from the model when 'auto'. Both tasks export a "
                               "causal LM with its KV cache (IPEX's fused cache).")
    optional.add_argument("--torch_dtype", default="float32", choices=DTYPES,
                          help="Weights and compute dtype of the export (default float32).")
    optional.add_argument("--backend", default="auto", choices=BACKENDS,
                          help="'ipex' fails when IPEX cannot be used; 'auto' falls back to the pure-PyTorch path.")
    optional.add_argument("--with_draft", action="store_true",
                          help="Also export the model's bf16 copy (its speculative-decoding draft, "
                               "IPEXModelForCausalLM.self_draft) into OUTPUT/draft-bf16.")
    optional.add_argument("--atol", type=float, default=None,
                          help="Validation tolerance on the max absolute logit difference between the reloaded "
                               "export and the eager transformers model (default 5e-4 for float32, 1.5 for "
                               "bfloat16).")
    optional.add_argument("--overwrite", action="store_true",
                          help="Replace an OUTPUT folder that holds an earlier export (kept until the new one is "
                               "complete). A folder holding anything else, the working directory, its parents, the "
                               "home folder and symbolic links are refused.")
    optional.add_argument("--trust_remote_code", action="store_true", help="Allow custom modeling code from the hub.")
    optional.add_argument("--revision", default=None, help="Hub revision (branch, tag or commit).")
    optional.add_argument("--cache_dir", default=None, help="Hub cache folder.")
    optional.add_argument("--local_files_only", action="store_true", help="Do not try to reach the hub.")


class IPEXExportCommand(BaseOptimumCLICommand):
    COMMAND = CommandInfo(name="ipex", help="Export a causal LM with Intel Extension for PyTorch (optimum-ipex-spec).")

    @staticmethod
    def parse_args(parser: ArgumentParser):
        return parse_args_ipex(parser)

    def run(self):
        from .export import ExportError, main_export

        a = self.args
        try:
            report = main_export(
                model=a.model, output=a.output, task=a.task, torch_dtype=a.torch_dtype, backend=a.backend,
                with_draft=a.with_draft, atol=a.atol, overwrite=a.overwrite, trust_remote_code=a.trust_remote_code,
                revision=a.revision, cache_dir=a.cache_dir, local_files_only=a.local_files_only,
            )
        except ExportError as exc:
            print(f"error: {exc}", file=sys.stderr)
            sys.exit(2)
        if not report.passed:
            sys.exit(1)
