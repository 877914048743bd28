"""Hand-written (reference answer, response, expected verdict) cases for the ``math`` reward. The
expected verdict is what a careful grader says; math-verify must say the same (see
test_math_verify_agreement.py)."""

from __future__ import annotations

CASES: list[tuple[str, str, bool]] = [
    # equivalent forms of numbers
    ("\\frac{1}{2}", "So $x = \\boxed{0.5}$.", True),
    ("\\frac{1}{2}", "The answer is 1/2.", True),
    ("0.5", "The answer is $\\frac{1}{2}$.", True),
    ("\\dfrac{3}{4}", "Therefore the probability is $\\boxed{0.75}$", True),
    ("\\frac{3}{4}", "$\\boxed{\\frac{6}{8}}$", True),
    ("1000", "We get \\boxed{1,000}", True),
    ("1000", "That gives \\boxed{10^3}", True),
    ("-3", "x = \\boxed{- 3}", True),
    ("2.5", "\\boxed{\\frac{5}{2}}", True),
    ("0.125", "\\boxed{\\frac{1}{8}}", True),
    ("12", "\\boxed{12.0}", True),
    ("\\sqrt{2}", "\\boxed{2^{1/2}}", True),
    ("\\frac{\\sqrt{3}}{2}", "The answer is $\\sqrt{3}/2$.", True),
    ("2\\sqrt{2}", "\\boxed{\\sqrt{8}}", True),
    ("\\pi", "\\boxed{\\pi}", True),
    ("2\\pi", "\\boxed{\\pi \\cdot 2}", True),
    ("e^{2}", "\\boxed{e^2}", True),
    ("\\frac{1}{3}", "\\boxed{0.3333333}", True),
    # expressions and equations
    ("x^2+2x+1", "\\boxed{(x+1)^2}", True),
    ("3", "\\boxed{x = 3}", True),
    ("2x+3", "\\boxed{3+2x}", True),
    ("\\frac{x}{2}", "\\boxed{0.5x}", True),
    ("a^2-b^2", "\\boxed{(a-b)(a+b)}", True),
    # units, percentages, degrees, currency
    ("5", "The length is \\boxed{5 \\text{ cm}}", True),
    ("5", "The length is \\boxed{5\\,\\mathrm{cm}}", True),
    ("30", "The angle is \\boxed{30^\\circ}", True),
    ("50\\%", "\\boxed{50}", True),
    ("6", "It costs \\boxed{\\$6}", True),
    ("18", "The answer is 18 dollars.", True),
    # intervals and sets
    ("(0,1]", "\\boxed{(0, 1]}", True),
    ("[2, \\infty)", "\\boxed{[2,\\infty)}", True),
    ("(-\\infty, 0) \\cup (1, \\infty)", "\\boxed{(-\\infty,0)\\cup(1,\\infty)}", True),
    ("\\{1,2\\}", "\\boxed{\\{2,1\\}}", True),
    ("1,2", "The solutions are \\boxed{2, 1}", True),
    # extraction: boxed beats other numbers, answer-is, last number
    ("7", "3 + 4 = 7, so the answer is \\boxed{7}. Check: 7 - 4 = 3.", True),
    ("42", "First 40, then 2 more.\nThe final answer is 42", True),
    ("42", "Answer: 42", True),
    ("9", "We add 4 and 5 to get 9", True),
    ("9", "We add 4 and 5 to get 9.\n", True),
    ("-12", "The temperature drops to -12", True),
    # wrong answers
    ("2", "\\boxed{3}", False),
    ("\\frac{1}{2}", "\\boxed{\\frac{1}{3}}", False),
    ("(0,1]", "\\boxed{[0,1]}", False),
    ("(0,1)", "\\boxed{(0,1]}", False),
    ("\\sqrt{2}", "\\boxed{1.41}", False),
    ("0.333", "\\boxed{\\frac{1}{3}}", False),
    ("1000", "\\boxed{100}", False),
    ("x^2+1", "\\boxed{(x+1)^2}", False),
    ("-3", "\\boxed{3}", False),
    ("\\{1,2\\}", "\\boxed{\\{1,2,3\\}}", False),
    ("5", "The answer is 6 cm.", False),
    ("42", "I do not know.", False),
    ("42", "", False),
    ("7", "The answer is \\boxed{8}, not 7.", False),
]
