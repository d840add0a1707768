"""tools, reasoning and system prompts

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-21 08:18:58.763691
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op


revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("chats", schema=None) as batch_op:
        batch_op.add_column(sa.Column("system_prompt", sa.Text(), nullable=True))
        batch_op.add_column(sa.Column("tools", sa.JSON(), nullable=True))

    with op.batch_alter_table("message_tokens", schema=None) as batch_op:
        batch_op.add_column(sa.Column("completion_text", sa.Text(), nullable=False, server_default=""))

    with op.batch_alter_table("messages", schema=None) as batch_op:
        batch_op.add_column(sa.Column("tool_call_id", sa.String(length=128), nullable=True))
        batch_op.add_column(sa.Column("reasoning_content", sa.Text(), nullable=True))
        batch_op.add_column(sa.Column("tool_calls", sa.JSON(), nullable=True))



def downgrade() -> None:
    with op.batch_alter_table("messages", schema=None) as batch_op:
        batch_op.drop_column("tool_calls")
        batch_op.drop_column("reasoning_content")
        batch_op.drop_column("tool_call_id")

    with op.batch_alter_table("message_tokens", schema=None) as batch_op:
        batch_op.drop_column("completion_text")

    with op.batch_alter_table("chats", schema=None) as batch_op:
        batch_op.drop_column("tools")
        batch_op.drop_column("system_prompt")

