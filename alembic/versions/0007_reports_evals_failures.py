"""reports, message evals and failure counts: OA's message reports and preference choices between
siblings; attempts that failed by a worker's fault, apart from requeues for infrastructure

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-23 10:15:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op


revision: str = '0007'
down_revision: str | None = '0006'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('messages', schema=None) as batch_op:
        batch_op.add_column(sa.Column('failures', sa.Integer(), server_default='0', nullable=False))
    op.create_table(
        'message_reports',
        sa.Column('id', sa.String(length=36), nullable=False),
        sa.Column('message_id', sa.String(length=36), nullable=False),
        sa.Column('user_id', sa.String(length=128), nullable=False),
        sa.Column('report_type', sa.String(length=32), nullable=False),
        sa.Column('reason', sa.Text(), nullable=False),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(['message_id'], ['messages.id'], ondelete='CASCADE'),
        sa.ForeignKeyConstraint(['user_id'], ['users.id'], ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('id'),
    )
    op.create_index('ix_message_reports_message_id', 'message_reports', ['message_id'], unique=False)
    op.create_table(
        'message_evals',
        sa.Column('id', sa.String(length=36), nullable=False),
        sa.Column('chat_id', sa.String(length=36), nullable=False),
        sa.Column('message_id', sa.String(length=36), nullable=False),
        sa.Column('user_id', sa.String(length=128), nullable=False),
        sa.Column('inferior_message_ids', sa.JSON(), nullable=False),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(['chat_id'], ['chats.id'], ondelete='CASCADE'),
        sa.ForeignKeyConstraint(['message_id'], ['messages.id'], ondelete='CASCADE'),
        sa.ForeignKeyConstraint(['user_id'], ['users.id'], ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('id'),
    )
    op.create_index('ix_message_evals_chat_id', 'message_evals', ['chat_id'], unique=False)


def downgrade() -> None:
    op.drop_index('ix_message_evals_chat_id', table_name='message_evals')
    op.drop_table('message_evals')
    op.drop_index('ix_message_reports_message_id', table_name='message_reports')
    op.drop_table('message_reports')
    with op.batch_alter_table('messages', schema=None) as batch_op:
        batch_op.drop_column('failures')
