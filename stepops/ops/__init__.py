"""The stepops custom ops, one package per op (schema, wrapper, kernels, samples)."""
