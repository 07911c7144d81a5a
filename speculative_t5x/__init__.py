"""speculative_t5x: exact speculative decoding and the Big Little Decoder for T5X-style T5 models."""

__version__ = '0.1.0'
