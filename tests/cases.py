"""Shared inputs of the engine and strategy tests (a question answerable only across two documents)."""
from fixtures import TINY_FAMILIES

FAMILIES = TINY_FAMILIES
QUESTION = "In which town was the first director of the Larkspur Observatory born?"
DOCS = [
    ("larkspur", "The Larkspur Observatory was built in 1887 on the slopes of Mount Helder. Its first director "
                 "was the astronomer Amelia Voss."),
    ("quillon", "The Quillon Lantern Festival was founded in 1923 by the glassblower Tomas Reyes."),
    ("voss", "Amelia Voss was born in the river town of Dunmore in 1851 and studied mathematics at Carvel."),
]
