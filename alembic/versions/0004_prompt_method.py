"""prompt method

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-23 03:10:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op


revision: str = '0004'
down_revision: str | None = '0003'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('message_tokens', schema=None) as batch_op:
        batch_op.add_column(sa.Column('prompt_method', sa.String(length=32), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('message_tokens', schema=None) as batch_op:
        batch_op.drop_column('prompt_method')
