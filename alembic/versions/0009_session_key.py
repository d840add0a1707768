"""session key: the client's session hint (X-Session-ID, prompt_cache_key) on messages stored through
the OpenAI-style routes, the tie-breaker between identical stored paths (server/openai/conversations.py)

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-26 17:10:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op


revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("messages", schema=None) as batch_op:
        batch_op.add_column(sa.Column("session_key", sa.String(length=128), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("messages", schema=None) as batch_op:
        batch_op.drop_column("session_key")
