"""What every part of the BMDB store shares: the URL it was opened with and its connection pool."""

from __future__ import annotations

from sqlalchemy.ext.asyncio import AsyncEngine


def sqlalchemy_url(url: str) -> str:
    """The SQLAlchemy URL for a ``postgresql://`` URL, with the psycopg 3 driver."""
    if url.startswith("postgresql://"):
        return "postgresql+psycopg://" + url[len("postgresql://") :]
    if url.startswith("postgres://"):
        return "postgresql+psycopg://" + url[len("postgres://") :]
    return url


class StoreBase:
    """The part of BMDB every topic's queries run on; BMDB (bmdb.store) opens it."""

    url: str
    engine: AsyncEngine
