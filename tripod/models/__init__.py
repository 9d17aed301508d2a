"""One decoder (or encoder) per model family, built from the layers; ``registry.py`` maps architectures to them."""
