"""One module per ``wacc`` subcommand (registered in :data:`wacc.cli.COMMANDS`)."""
