"""Examples that run end to end.

- `digits`: an MLP on scikit-learn's bundled digits (`make demo`, `python -m nitro.examples.digits`)
"""
