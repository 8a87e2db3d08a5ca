"""The `refit` command's subcommands, one module each: `add_parser(sub, common)` and `run(args, console)`,
registered in `refit.tools.cli.COMMANDS`."""
