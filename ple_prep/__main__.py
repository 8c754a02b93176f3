from .cli import cli

cli(prog_name="ple-prep")
