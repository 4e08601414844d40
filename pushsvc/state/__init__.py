"""Pure state: matching tables, leases, watchdogs and block planning. No I/O, no clocks."""
