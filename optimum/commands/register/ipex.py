# Registers `optimum-cli export ipex` (optimum's PEP 420 plugin namespace: no __init__.py here).
# Kept import-light: the command module imports torch/transformers only inside run().
from optimum.commands.export.base import ExportCommand

from optimum_ipex_spec.cli.export_ipex import IPEXExportCommand

REGISTER_COMMANDS = [(IPEXExportCommand, ExportCommand)]
