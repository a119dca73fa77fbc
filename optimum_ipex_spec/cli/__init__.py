"""The command line: ``optimum-cli export ipex`` (export.py; the command class, export_ipex.py, is registered from
optimum/commands/register/ipex.py)."""
