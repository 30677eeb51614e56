"""Planning without a launch: machine descriptions, the parameter/memory/FLOP model of a
deck on a grid, and the dry run (`python -m app DECK --dry-run`)."""
