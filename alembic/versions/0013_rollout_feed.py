"""rollout feed: each finished episode's position in GET /v1/rollouts, and the deployment's shared
secrets (the key that signs feed cursors)

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-29 10:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op


revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("messages", schema=None) as batch_op:
        batch_op.add_column(sa.Column("feed_seq", sa.BigInteger(), nullable=True))
        batch_op.create_index("ix_messages_feed_seq", ["feed_seq"], unique=True)
    op.create_table(
        "server_secrets",
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("value", sa.String(length=128), nullable=False),
        sa.PrimaryKeyConstraint("name"),
    )
    # episodes that ended before the feed existed join it in the order their rewards were posted
    messages = sa.table(
        "messages",
        sa.column("id", sa.String),
        sa.column("episode_done", sa.Boolean),
        sa.column("rewarded_at", sa.DateTime),
        sa.column("feed_seq", sa.BigInteger),
    )
    conn = op.get_bind()
    done = conn.execute(
        sa.select(messages.c.id)
        .where(messages.c.episode_done.is_(True))
        .order_by(messages.c.rewarded_at, messages.c.id)
    ).all()
    for seq, (message_id,) in enumerate(done, start=1):
        conn.execute(messages.update().where(messages.c.id == message_id).values(feed_seq=seq))


def downgrade() -> None:
    op.drop_table("server_secrets")
    with op.batch_alter_table("messages", schema=None) as batch_op:
        batch_op.drop_index("ix_messages_feed_seq")
        batch_op.drop_column("feed_seq")
