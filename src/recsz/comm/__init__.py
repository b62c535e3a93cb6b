"""Compressed all-to-all: byte exchange (sizes, then payloads) and the embedding exchange."""

from recsz.comm.embedding import EmbeddingExchange
from recsz.comm.exchange import frame, start_all_to_all_bytes, unframe
from recsz.comm.stats import CommStats

__all__ = ["CommStats", "EmbeddingExchange", "frame", "start_all_to_all_bytes", "unframe"]
