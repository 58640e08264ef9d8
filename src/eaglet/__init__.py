"""eaglet: train EAGLE-3 draft models for a target LLM and prove they make it decode faster."""

__version__ = "0.1.0"
