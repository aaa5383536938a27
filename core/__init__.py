"""The decoding engine: trees, acceptance rules, the decode step and the generation loop.

It knows transformers models and tensors, never the UI (no gradio, no `app` imports) and
never where weights come from (that is `models`).
"""
