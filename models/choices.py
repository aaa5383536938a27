"""The names of the loader's choices, importable without torch: the command line reads them
before anything heavy loads (`models.loader` maps them to what they mean)."""

DTYPE_NAMES = ("float32", "bfloat16", "float16")  # torch dtypes by their names in torch
QUANTIZATIONS = ("auto", "none", "nf4", "int8", "int4")  # int4: weight-only, CPU, Llama-family
