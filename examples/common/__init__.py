"""Code shared by the GACT examples: data loaders, the training-loop helpers, measurement."""
