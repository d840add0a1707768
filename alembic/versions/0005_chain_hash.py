"""chain hash: the prefix index of conversations stored through the OpenAI API

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-23 10:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op


revision: str = '0005'
down_revision: str | None = '0004'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('messages', schema=None) as batch_op:
        batch_op.add_column(sa.Column('chain_hash', sa.String(length=64), nullable=True))
        batch_op.create_index('ix_messages_chain_hash', ['chain_hash'], unique=False)
    with op.batch_alter_table('message_tokens', schema=None) as batch_op:
        batch_op.add_column(sa.Column('prompt_check', sa.String(length=32), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('message_tokens', schema=None) as batch_op:
        batch_op.drop_column('prompt_check')
    with op.batch_alter_table('messages', schema=None) as batch_op:
        batch_op.drop_index('ix_messages_chain_hash')
        batch_op.drop_column('chain_hash')
