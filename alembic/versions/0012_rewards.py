"""rewards: the environment's reward of an assistant turn (POST /v1/rewards) and whether the episode
ended there

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-29 09:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op


revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("messages", schema=None) as batch_op:
        batch_op.add_column(sa.Column("reward", sa.Float(), nullable=True))
        batch_op.add_column(sa.Column("episode_done", sa.Boolean(), server_default=sa.false(), nullable=False))
        batch_op.add_column(sa.Column("rewarded_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("messages", schema=None) as batch_op:
        batch_op.drop_column("rewarded_at")
        batch_op.drop_column("episode_done")
        batch_op.drop_column("reward")
