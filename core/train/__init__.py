"""Offline work: training Medusa heads and EAGLE drafters, calibrating trees, collecting replies.
It imports the runtime; the runtime never imports it."""


def runnable(model):
    """The model whose transformers forward computes `model`'s: itself, or where it was built
    without transformers' model code (`models.light`) transformers' model sharing its modules."""
    return model.hf_model() if hasattr(model, "hf_model") else model
