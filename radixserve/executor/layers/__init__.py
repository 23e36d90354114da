"""Building blocks a causal LM is made of: linear layers (plain, quantized, tensor-parallel),
norms, activations and rotary embeddings. A model file composes these; tensor parallelism
comes from ``parallel`` (vocabulary-parallel embedding and head, row-parallel reduction),
so no model has a ``*_tp`` twin."""
