"""The commands of `medusa-chat`, one module each: `add_arguments(parser)` and `run(args)`."""
