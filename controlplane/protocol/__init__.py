"""The bus contract: every message, subject, stream and header name. Pure: pydantic only."""
