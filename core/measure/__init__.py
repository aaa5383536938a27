"""Measuring the user's machine at run time: device-synchronized clocks, kernel choices, step costs and profiles."""
