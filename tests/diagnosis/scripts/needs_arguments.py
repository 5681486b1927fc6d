"""A training script run without its required argument: argparse exits 2 before any step."""

import argparse

parser = argparse.ArgumentParser()
parser.add_argument("--data", required=True)
parser.parse_args()
