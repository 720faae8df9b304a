"""What people see: terminal tables and the live view, HTML reports, JSON schemas, status and the dashboard."""
