"""Offline work: training Medusa heads and EAGLE drafters, calibrating trees, collecting replies.
It imports the runtime; the runtime never imports it."""
