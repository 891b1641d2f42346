"""Model definitions, one module per architecture family."""
