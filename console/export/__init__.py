"""Streaming traffic records and audit entries to a SIEM: OTLP/HTTP logs and RFC 5424 syslog over
TLS, at least once, from cursors stored in the database (docs/specs/console.md "SIEM export")."""
