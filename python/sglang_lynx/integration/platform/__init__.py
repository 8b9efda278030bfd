"""Platform glue: CPU-host defaults (``cpu_host``), start-up refusals (``deployment_check``), and the
table of Lynx machinery each mode needs (``runtime``), the health gate (``health_gate``) and the router's process entry
our launcher starts (``router_process``)."""
