"""Data shipped with medusa-chat: tree presets, styles, trained heads. No code."""
