"""Model definitions: configs read from HF config.json (config.py), presets
(presets.py) and the decoder built from TP-aware layers (decoder.py)."""
