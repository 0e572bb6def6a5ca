"""Memory bookkeeping: pages of KV rows with reservation leases, and slots for fixed states."""
