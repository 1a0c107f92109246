"""Reporting: run rows and files, statistics, charts."""
