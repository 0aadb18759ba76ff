# R's print() of numeric vectors and matrices, for chapter 2's emulation of
# it (r_format_vector, r_format_matrix). Run by tools/check/r_print_fixtures.py,
# which stores the output as tests/fixtures/r_print_cases.json; the tests
# compare the book's emulation with that file, without R.
#
# Each case prints:
#   @@case <name> <vector|matrix> <nrow>
#   @@values <the doubles, column by column, as sprintf("%a") or NA>
#   <print(x) exactly as R writes it>
#   @@end
# Default options: digits = 7, width = 80, scipen = 0.

options(digits = 7, width = 80, scipen = 0)

emit <- function(name, x) {
  kind <- if (is.matrix(x)) "matrix" else "vector"
  rows <- if (is.matrix(x)) nrow(x) else length(x)
  v <- as.vector(x)
  hex <- ifelse(is.na(v), "NA", sprintf("%a", v))
  cat("@@case", name, kind, rows, "\n")
  cat("@@values", hex, "\n")
  print(x)
  cat("@@end\n")
}

# --- ties and near-ties between fixed and scientific notation ---------------
# R prints fixed when its width is at most the scientific width (R's
# formatReal, src/main/format.c); tie_* cases have equal widths.
emit("tie_0.00012", c(0.00012))                 # 0.00012 vs 1.2e-04: tie
emit("tie_neg_0.00012", c(-0.00012))
emit("tie_0.0001234", c(0.0001234))             # 9 vs 9
emit("sci_0.0001", c(0.0001))                   # 0.0001 (6) vs 1e-04 (5)
emit("tie_1234500000", c(1234500000))           # 10 vs 1.2345e+09 (10)
emit("sci_1e5", c(1e5))                         # 100000 (6) vs 1e+05 (5)
emit("fixed_123456", c(123456))
emit("sci_1e5_and_1", c(1e5, 1))
emit("fixed_120000_3", c(120000, 3))            # 120000 (6) vs 1.2e+05 (7)
emit("tie_10000", c(10000))                     # 10000 vs 1e+04: tie
emit("tie_0.001", c(0.001))                     # 0.001 vs 1e-03: tie
emit("sci_1e15", c(1e15))
emit("sci_1e15_and_half", c(1e15, 0.5))
emit("sci_1.5e-5", c(1.5e-5))                   # 0.000015 (8) vs 1.5e-05 (7)
emit("tie_neg_0.00012_and_half", c(-0.00012, 0.5))  # -0.00012 vs -1.2e-04
emit("tie_matrix_column", matrix(c(0.00012, 1, 10000, 2), 2))

# --- digits = 7: rounding to seven significant digits -----------------------
emit("third", c(1 / 3))
emit("pi_powers", c(pi, pi * 100, pi / 100))
emit("round_up_to_power", c(9999999.6))         # 7 digits round to 1e+07
emit("round_0.99999996", c(0.99999996))
emit("seven_digits", c(1234567.8))
emit("point_one_plus_two", c(0.1 + 0.2))
emit("two_pow_52", c(2^52))
emit("two_pow_53_plus", c(2^53 + 2))

# --- negative zero -----------------------------------------------------------
emit("neg_zero", c(-0))
emit("neg_zero_mixed", c(-0, 1.5, -2))
emit("neg_zero_matrix", matrix(c(-0, 1, 2.5, -0), 2))

# --- large and small magnitudes ---------------------------------------------
emit("tiny", c(1e-300))
emit("huge", c(1e300))
emit("three_digit_exponent_mixed", c(1e-300, 1, -2e100))
emit("denormal", c(5e-324))
emit("max_double", c(.Machine$double.xmax))
emit("small_and_large", c(1e-10, -3, 2))
emit("large_and_fraction", c(123456789, 0.1))

# --- widths: vectors -------------------------------------------------------
emit("ten_entries", c(3, 1, 4, 1, 5, 9, 2, 6, 5, 3))  # label " [1]"
emit("negative_sets_width", c(-1, 10))
emit("mixed_decimals", c(1.5, -22.25, 333.125))
emit("one_entry_per_width", c(0.001, 10, -1000.5))
emit("exactly_80", c(-1:-7) / 7)                 # 3 + 7 * 11 characters
emit("wraps_ten_sevenths", c(1:10) / 7)          # 104: R wraps, port refuses
emit("wraps_thirty", c(1:30) / 7)

# --- widths: matrices (each column its own layout) -------------------------
emit("matrix_columns_differ", matrix(c(0.001, 2, 3e8, 4, 5.5, -6), 2))
emit("matrix_sci_column", matrix(c(1e-10, 1, 0.5, 0.25), 2))
emit("matrix_header_wider", matrix(c(1, 2, 3, 4), 2))
emit("matrix_ten_rows", matrix(c(1:10) / 4, 10))    # labels " [1,]".."[10,]"
emit("matrix_nine_rows", matrix(c(1:9) / 4, 9))      # R sizes for nrow + 1
emit("matrix_ninety_nine_rows", matrix(c(1:99) / 8, 99))
emit("matrix_negative_column", matrix(c(-1.25, 3, 0, -0.5, 7, 8), 3))
emit("matrix_mixed_magnitudes",
     matrix(c(123456789, 0.1, 1e-5, -2, 1e15, 3, 0.12345678, 1), 2))
# a matrix line stays under 80 (printMatrix): at 80 R starts a new block
emit("matrix_79_one_block", matrix(c(rep(1 / 3, 7), 1.12), 1))
emit("matrix_80_wraps", matrix(c(rep(1 / 3, 7), 1.125), 1))  # port refuses

# --- widths by R's rule, not the longest entry (issue 47) -------------------
# R's width for fixed notation counts the digits left of "." of the entry
# rounded to 7 significant digits; sprintf then prints it unrounded
emit("rounds_up_fixed_width", c(9.9999996, 0.001234567))   # 10.00000: 2 left
emit("matrix_rounds_up_width", matrix(c(99999.9996, 123.456789), 2))
emit("rounds_up_99999.99996", c(99999.99996))              # 1e+05
emit("rounds_up_999999.96_half", c(999999.96, 0.5))
emit("rounding_widens_99999999.4", c(99999999.4))         # 1e+08
emit("rounding_widens_with_1234567.1", c(99999999.4, 1234567.1))  # width 8
emit("rounds_up_with_1234567.1", c(99999999.6, 1234567.1))  # width 9
# every entry gets the width of a three-digit exponent
emit("three_digit_exponent_width", c(-1.5, 1e100))
emit("rounds_to_1e100", c(9.9999999e99, 1))
emit("exponent_minus_99", c(1e-99, 1))                    # two digits
emit("exponent_minus_100", c(1e-100, 1))                  # three digits
emit("neg_rounds_to_1e-99", c(-9.9999999e-100, 1))

# --- R's long double: ties at the 7th digit ----------------------------------
# R scales x by a power of 10 in long double (64-bit significand) and rounds
# that to 7 digits, ties to even; sprintf rounds the exact double. For
# |kp| <= 27 the power is tbl[|kp|] in format.c: double literals (1e23, ...),
# so 10^k exactly up to 10^22, the double nearest 10^k for 10^23 to 10^27
emit("dyadic_tie_2^-11", c(2^-11))                        # 0.00048828125
emit("dyadic_tie_1234567.5", c(1234567.5, 1))
emit("long_double_tie_0.47824295", c(0x1.e9b885172b95bp-2))  # 0.4782429499..
emit("long_double_tie_0.33425705", c(0x1.56477ae8d46a5p-2))
emit("long_double_tie_0.010239995", c(0x1.4f8b4dd16f1dfp-7))
emit("table_limit_1e33", c(1.2345675e33, -1))  # tbl[27]: the double nearest 10^27
# near-ties scaled by tbl[23..27] (|x| in [1e-21, 1e-16) or [1e29, 1e34) at
# 7 digits): the exact power of 10 would round them the other way
emit("table_tie_1.00018e-21", c(0x1.2e4923fe0b3bdp-70))      # tbl[27]
emit("table_tie_1.000070e+33", c(0x1.8a7536acd844ep+109))    # tbl[27]
emit("table_tie_1.000010e-17_and_half", c(0x1.70f03a16942a2p-57, 0.5))  # tbl[23]
emit("table_tie_matrix_1.00018e-21", matrix(c(0x1.2e4923fe0b3bdp-70, 1), 1))
emit("table_tie_5.889820e-21", c(0x1.bd05b27c0fc07p-68))     # tbl[27]
emit("table_tie_neg_3.41577e-19", c(-0x1.93434c6e6e82fp-62)) # tbl[25]
emit("table_tie_3.794400e-17", c(0x1.5df8b9a09e378p-55))     # tbl[23]
emit("table_tie_9.34335e+29", c(0x1.795ff8335e9dcp+99))      # tbl[23]
emit("table_tie_8.46576e+31", c(0x1.0b21de63ea3f1p+106))    # tbl[25]
emit("table_tie_neg_8.048330e+33", c(-0x1.8cd0332dd6aebp+112))  # tbl[27]
emit("powl_1e34_and_1e-30", c(1.2345675e34, 1.234567e-30, 3.3e40))
emit("subnormal_and_one", c(5e-324, 1))
# beyond 10^27 R divides by powl(10, k), not exactly rounded: near a tie
# that decides a trailing zero, the port refuses
emit("refused_powl_tie_5.3861405e-244", c(0x1.d6be480dded40p-809))
emit("refused_powl_tie_9.9767895e110", c(0x1.a8cec4c97c620p+368))

# --- what the emulation does not print --------------------------------------
emit("na_vector", c(1.5, NA, 3))
emit("na_matrix", matrix(c(1, NA, 3, 4), 2))
