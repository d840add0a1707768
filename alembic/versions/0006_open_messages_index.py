"""open messages index: the sweep and the per-user queue share find pending and in-progress messages

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-23 12:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op


revision: str = '0006'
down_revision: str | None = '0005'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_OPEN = "state IN ('pending', 'in_progress')"


def upgrade() -> None:
    op.create_index(
        'ix_messages_open',
        'messages',
        ['state', 'modified_at'],
        unique=False,
        sqlite_where=sa.text(_OPEN),
        postgresql_where=sa.text(_OPEN),
    )


def downgrade() -> None:
    op.drop_index('ix_messages_open', table_name='messages')
