"""Texts for benchmarks/speculation_workloads.py, written for it (fictional people, places and
figures): passages to extract from and records to fill a JSON object from. Each has facts (names,
dates, amounts) a faithful answer repeats verbatim, which is what draft sources that copy from
the prompt can guess."""
from __future__ import annotations

# (passage, what to extract): the answer should quote the passage.
PASSAGES: tuple[tuple[str, str], ...] = (
    ("The Harwick Point lighthouse was first lit on 14 March 1871, after four years of building on a "
     "reef that had sunk eleven ships in the previous decade. Its keeper for the first thirty years, "
     "Agnes Morrow, kept a log of every vessel that passed, and her entries show that the light was dark "
     "on only two nights: once during the great storm of November 1893, when the lantern glass shattered, "
     "and once in 1899, when the oil delivery failed to arrive. The light was automated in 1962 and the "
     "keeper's cottage became a small museum in 1985, where the original log books are still on display.",
     "List every date or year in the passage, each with the sentence it appears in, quoted exactly."),
    ("At its meeting on Tuesday the Linfield city council voted six to three to build protected bike lanes "
     "on Carver Street and Elm Avenue. Councillor Rosa Delgado, who proposed the plan, said the lanes would "
     "cost 2.4 million dollars and would be finished by the end of next summer. Councillor Tom Hale voted "
     "against it, saying that removing 140 parking spaces would hurt the shops on Carver Street. The council "
     "also agreed to review the lanes after one year, using counts of cyclists and the number of "
     "collisions reported to the police.",
     "Summarize the passage in three sentences, quoting the councillors' names, the vote and the cost exactly."),
    ("Brightwell Appliances is recalling about 38,000 Model KT-220 electric kettles sold between June 2023 "
     "and January 2024. The kettle's base can overheat when the kettle is switched on without water, which "
     "poses a fire hazard. The company has received 27 reports of bases melting, including three reports of "
     "minor burns. Customers should stop using the kettle immediately and contact Brightwell for a full "
     "refund of 49.99 dollars or a free replacement. The model number is printed on a white label under "
     "the base.",
     "Which product is recalled, why, and what should customers do? Answer with quotes from the notice."),
    ("We sampled soil from 64 wheat fields in three regions and measured the abundance of nitrogen-fixing "
     "bacteria before and after a season of reduced tillage. Fields that were ploughed once instead of "
     "three times showed a 23 percent increase in bacterial abundance on average, while fields left "
     "untilled showed a 31 percent increase. Yields did not differ significantly between the groups. "
     "These results suggest that reduced tillage can improve soil biology without a loss of yield, "
     "although the study covered only a single growing season.",
     "Extract the study's method, its two main figures and its stated limitation, quoting the abstract."),
    ("Version 3.2 of the Quillmark editor adds split panes, so two files can be edited side by side, and "
     "a new command palette opened with Ctrl+Shift+P. Search is now about four times faster in large "
     "projects because the index is kept in memory between searches. The settings file moved from "
     "settings.ini to settings.toml; Quillmark converts the old file the first time it starts. Support "
     "for Windows 7 has been removed. Thanks to Priya Raman and Jonas Becker for the split pane work.",
     "List each change in this release note as a bullet that quotes the note's own words."),
    ("The exhibition Threads of the Silk Road, open at the Almont Museum from 5 April to 28 September, "
     "brings together 212 textiles from collections in nine countries. The oldest piece, a fragment of "
     "patterned silk found near Dunhuang, is more than 1,500 years old. Curator Mei Lin Zhao arranged the "
     "rooms along the route itself, from Chang'an in the east to Antioch in the west, so that visitors "
     "see how designs changed as they travelled. Tickets cost 18 dollars, and entry is free on the first "
     "Sunday of each month.",
     "Quote the sentences that give the exhibition's dates, size, curator and prices."),
    ("Heavy rain on Saturday night caused the river Tane to rise 2.7 metres in six hours, flooding the "
     "lower part of Millbridge. About 300 homes were evacuated, and the emergency shelter at Millbridge "
     "High School took in 85 people. No injuries were reported. The regional water authority said the new "
     "flood wall on the east bank held, but water came over the older wall near the old mill. The Millbridge "
     "road bridge will stay closed until engineers have inspected it, which is expected to take until "
     "Wednesday.",
     "Summarize what happened, quoting the figures for the river, the evacuations and the shelter exactly."),
    ("Elena Varga was born in Szeged in 1902 and studied mathematics in Budapest and Göttingen. Her thesis, "
     "completed in 1927, gave the first complete proof of what is now called Varga's lemma on lattice "
     "coverings. She left Europe in 1938 for a post at Calder College, where she taught for thirty-one "
     "years and supervised forty doctoral students. In 1954 she became the first woman elected president "
     "of the Calder Mathematical Society. She died in 1981; the college's mathematics library now bears "
     "her name.",
     "Give a timeline of Elena Varga's life, each entry quoting the passage's own words."),
)

# (text, the object a faithful answer fills in): every value appears verbatim in the text.
RECORDS: tuple[tuple[str, dict[str, str]], ...] = (
    ("Invoice 2024-0117 from Northgate Timber Ltd to Carla Jensen, dated 9 February 2024. Twelve cedar "
     "planks at 14.50 each and one box of brass screws at 22.00; total due 196.00 pounds by 9 March 2024.",
     {"invoice_number": "2024-0117", "seller": "Northgate Timber Ltd", "buyer": "Carla Jensen",
      "date": "9 February 2024", "total": "196.00 pounds", "due_date": "9 March 2024"}),
    ("Registration confirmed: Marcus O'Neill will attend the Coastal Ecology Workshop in Port Alder from "
     "17 to 19 October 2024. Fee paid: 275 dollars (early rate). Dietary note: vegetarian. Badge name: Marc.",
     {"name": "Marcus O'Neill", "event": "Coastal Ecology Workshop", "place": "Port Alder",
      "dates": "17 to 19 October 2024", "fee": "275 dollars", "dietary_note": "vegetarian", "badge_name": "Marc"}),
    ("The lease for Flat 4B, 31 Rowan Terrace, runs from 1 September 2024 to 31 August 2025. Tenant: Aisha "
     "Karimi. Landlord: Peter Gould. Monthly rent is 1,150 pounds, payable on the first of each month, with "
     "a deposit of 1,725 pounds.",
     {"address": "Flat 4B, 31 Rowan Terrace", "tenant": "Aisha Karimi", "landlord": "Peter Gould",
      "start_date": "1 September 2024", "end_date": "31 August 2025", "monthly_rent": "1,150 pounds",
      "deposit": "1,725 pounds"}),
    ("Booking reference QX7P2L. Passenger: Daniel Ortega. Flight BA 2491 from London Gatwick to Lisbon on "
     "22 June 2024, departing 07:45, seat 14C. Fare 189.40 euros including one checked bag of 23 kg.",
     {"reference": "QX7P2L", "passenger": "Daniel Ortega", "flight": "BA 2491", "from": "London Gatwick",
      "to": "Lisbon", "date": "22 June 2024", "departure_time": "07:45", "seat": "14C", "fare": "189.40 euros"}),
    ("Dear Sofia Lindqvist, we are pleased to offer you the position of Senior Data Analyst at Harbor "
     "Logistics, starting 3 June 2024, with an annual salary of 68,000 euros and 28 days of paid leave. "
     "Please reply by 10 May 2024. Signed, Grace Adeyemi, Head of People.",
     {"candidate": "Sofia Lindqvist", "position": "Senior Data Analyst", "company": "Harbor Logistics",
      "start_date": "3 June 2024", "salary": "68,000 euros", "leave_days": "28", "reply_by": "10 May 2024",
      "signed_by": "Grace Adeyemi"}),
    ("Appointment reminder: Mr Henry Blake is booked with Dr Naomi Fischer at Elmfield Health Centre on "
     "Thursday 14 November 2024 at 10:20. Please arrive ten minutes early. Cancellations: 01632 960 418.",
     {"patient": "Henry Blake", "doctor": "Naomi Fischer", "clinic": "Elmfield Health Centre",
      "date": "Thursday 14 November 2024", "time": "10:20", "phone": "01632 960 418"}),
    ("Sold on 2 August 2024: a 2017 Toyota Corolla, registration LK17 WXR, 84,300 miles, by Owen Price to "
     "Leah Morgan for 8,950 pounds, paid by bank transfer. The seller keeps the private plate.",
     {"date": "2 August 2024", "car": "2017 Toyota Corolla", "registration": "LK17 WXR", "mileage": "84,300 miles",
      "seller": "Owen Price", "buyer": "Leah Morgan", "price": "8,950 pounds", "payment": "bank transfer"}),
    ("Talk accepted for PyNorth 2024: 'Profiling without tears' by Kenji Watanabe, 30 minutes, Room B, "
     "Saturday 12 October at 14:00. Travel grant: 400 dollars. Slides due by 5 October.",
     {"title": "Profiling without tears", "speaker": "Kenji Watanabe", "conference": "PyNorth 2024",
      "length": "30 minutes", "room": "Room B", "date": "Saturday 12 October", "time": "14:00",
      "travel_grant": "400 dollars", "slides_due": "5 October"}),
)

# Open questions: little in the prompt to copy.
QUESTIONS: tuple[str, ...] = (
    "What are some good ways to stay focused when working from home?",
    "Why is the sky blue during the day and red at sunset?",
    "Suggest a plan for learning to play the guitar in three months.",
    "What should I think about before adopting a dog?",
    "Explain the difference between weather and climate.",
    "Write a short poem about a city waking up in the morning.",
    "How do vaccines help the body fight infections?",
    "Give me ideas for a birthday party for a ten-year-old.",
)

# The code model's open prompts: a signature and docstring, nothing to copy from.
FUNCTION_STARTS: tuple[str, ...] = (
    'def slugify(title):\n    """Turn an article title into a lowercase URL slug."""',
    'def read_config(path):\n    """Read an INI file and return its sections as a dict of dicts."""',
    'def is_prime(n):\n    """Return True if n is a prime number."""',
    'def flatten(nested):\n    """Yield the items of arbitrarily nested lists, depth first."""',
    'def retry(func, attempts=3, delay=1.0):\n    """Call func until it succeeds, sleeping delay seconds between attempts."""',
    'class LRUCache:\n    """A dictionary that forgets its least recently used key when full."""',
    'def parse_duration(text):\n    """Parse strings such as "1h30m" or "45s" into a number of seconds."""',
    'def word_counts(path):\n    """Count how often each word occurs in a text file."""',
)
