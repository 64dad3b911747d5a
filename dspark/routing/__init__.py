"""QoS routing: tier scheduling, traffic graying and shadow traffic (no pb_utils here)."""
