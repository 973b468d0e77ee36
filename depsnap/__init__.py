"""Dependency snapshots: what a job installs at start-up, captured once as a layer and stacked under later runs."""
