"""Storage: one store interface (reads, and a single writer that commits jobs in groups); SQLite is the embedded engine."""
