"""Compressed all-to-all: byte exchange (sizes, then payloads) and the embedding exchange."""

from recsz.comm.embedding import EmbeddingExchange
from recsz.comm.exchange import start_all_to_all_bytes
from recsz.comm.stats import CommStats

__all__ = ["CommStats", "EmbeddingExchange", "start_all_to_all_bytes"]
