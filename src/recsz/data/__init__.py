"""Criteo data: raw reader, binary preprocessing, synthetic generator, batch sources."""

from recsz.data.criteo import CriteoFormatError
from recsz.data.source import Batch, DataSource, make_source

__all__ = ["Batch", "CriteoFormatError", "DataSource", "make_source"]
