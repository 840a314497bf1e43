"""Stage package (see DESIGN.md); filled by its own issue."""
