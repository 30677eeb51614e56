"""Post-processing of run reports into tables and plots."""
