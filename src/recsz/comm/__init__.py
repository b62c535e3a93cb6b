"""Compressed all-to-all: byte exchange (sizes, then payloads) and the embedding exchange."""

from recsz.comm.embedding import CommStats, EmbeddingExchange
from recsz.comm.exchange import frame, start_all_to_all_bytes, unframe

__all__ = ["CommStats", "EmbeddingExchange", "frame", "start_all_to_all_bytes", "unframe"]
