"""What the user touches: the command line (and the chat UI)."""
