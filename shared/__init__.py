"""Wire schemas, error codes and pure token utilities shared by server, worker and clients.

Nothing here performs I/O or imports server or worker code.
"""
