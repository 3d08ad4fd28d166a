/* One token's row selection for a gated MLP: the k rows with the largest predicted
 * |act(gate x) * (up x)|, in one pass over N floats, for the mask sources that compute the
 * gate exactly (CATS, the gated trained predictor).
 *
 * score_i = |g_i| * E|u_i|, u_i ~ Normal(mean_i, sd_i^2):
 *     E|u| = sd sqrt(2/pi) exp(-z^2/2) + mean erf(z/sqrt 2), z = mean/sd (|mean| where sd
 *     is 0), or score_i = |g_i| without an up estimate (CATS).
 * The k largest are found by a radix select on the scores' bits (non-negative floats order
 * as their bit patterns): four 8-bit digit passes, O(N) whatever the input, no sort. Ties at
 * the k-th score go to the lowest row ids; a NaN score ranks above +inf (torch.topk's order).
 * The picked ids come out ascending, with g at them: what pc_rows_mlp_f32 reads.
 *
 * In torch the same selection is ~15 elementwise kernels, a top-k, a scatter into a mask and
 * a nonzero, each a few microseconds of dispatch on N = 1536: about 60 µs of a ~650 µs
 * layer (SmolLM2, one thread), more than this whole function.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "pc_internal.h"

#define PC_SQRT_2_OVER_PI 0.7978845608028654f

/* The score's bits as an unsigned key: scores are >= 0, so the keys order as the floats do;
 * -0 is 0 and NaN is above +inf. */
static inline uint32_t score_key(float s) {
    if (isnan(s)) return UINT32_MAX;
    if (s <= 0.0f) return 0; /* -0.0 and 0.0 alike */
    uint32_t key;
    memcpy(&key, &s, sizeof key);
    return key;
}

/* exp(x) for x in [-87, 0]: x = n ln2 + r, |r| <= ln2/2, e^r by Cephes' expf polynomial,
 * 2^n by the exponent bits. About 1 ulp, and plain arithmetic, so that the loop below
 * vectorises (libm's expf and erff are calls, ~20 ns per element together). */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x; /* e^-87 ~ 1.6e-38: still normal (a NaN lane is not used) */
    const float shifter = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
    float t = x * 1.44269504088896341f + shifter;
    uint32_t tbits;
    memcpy(&tbits, &t, sizeof tbits);
    float n = t - shifter;
    float r = x - n * 0.693359375f - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    /* n = tbits - bits(shifter) in [-126, 0]: 2^n has exponent bits n + 127. */
    uint32_t scale_bits = (tbits - 0x4B400000u + 127u) << 23;
    float scale;
    memcpy(&scale, &scale_bits, sizeof scale);
    return p * scale;
}

/* E|u| for u ~ Normal(mean, sd^2): sd sqrt(2/pi) e^(-z^2/2) + |mean| erf(|z|/sqrt 2),
 * z = mean/sd, with erf by Abramowitz and Stegun 7.1.26, erf(a) = 1 - P(t) e^(-a^2),
 * t = 1/(1 + 0.3275911 a), |error| <= 1.5e-7: the same e^(-z^2/2) serves both terms.
 * Relative error ~2e-7 against the exact value; |mean| where sd is not > 0. */
static inline float expected_abs(float mean, float sd) {
    float am = fabsf(mean);
    float z = am / (sd > 0.0f ? sd : 1.0f); /* no division by 0: the loop stays branch-free */
    float e = exp_nonpositive(-0.5f * z * z);
    float t = 1.0f / (1.0f + 0.3275911f * 0.7071067811865476f * z);
    float poly = t * (0.254829592f +
                      t * (-0.284496736f + t * (1.421413741f + t * (-1.453152027f + t * 1.061405429f))));
    float v = sd * PC_SQRT_2_OVER_PI * e + am * (1.0f - poly * e);
    return sd > 0.0f ? v : am;
}

void pc_expected_abs_f32(const float *mean, const float *sd, int64_t n, float *out) {
    for (int64_t i = 0; i < n; i++) out[i] = expected_abs(mean[i], sd[i]);
}

int pc_select_gated_f32(const float *g, const float *up_mean, const float *up_sd, int64_t n,
                        int64_t k, int32_t *idx, float *g_at) {
    if (g == NULL || idx == NULL || g_at == NULL || n < 1 || n > INT32_MAX || k < 1 || k > n ||
        (up_mean == NULL) != (up_sd == NULL))
        return PC_ERR_CONFIG;
    uint32_t *keys = malloc((size_t)n * sizeof *keys);
    float *scores = malloc((size_t)n * sizeof *scores);
    if (keys == NULL || scores == NULL) {
        free(keys);
        free(scores);
        return PC_ERR_NOMEM;
    }
    /* Two loops, so that the scoring one vectorises. */
    if (up_mean != NULL)
        for (int64_t i = 0; i < n; i++) scores[i] = fabsf(g[i]) * expected_abs(up_mean[i], up_sd[i]);
    else
        for (int64_t i = 0; i < n; i++) scores[i] = fabsf(g[i]);
    for (int64_t i = 0; i < n; i++) keys[i] = score_key(scores[i]);
    free(scores);
    /* The k-th largest key, a digit at a time from the top: `prefix` holds the digits fixed
     * so far, `need` how many of the k are still to be found among the keys that share it. */
    uint32_t prefix = 0, fixed = 0; /* fixed: mask of the digits set in prefix */
    int64_t need = k;
    for (int shift = 24; shift >= 0; shift -= 8) {
        int64_t count[256] = {0};
        for (int64_t i = 0; i < n; i++)
            if ((keys[i] & fixed) == prefix) count[(keys[i] >> shift) & 0xff]++;
        int digit = 255;
        for (; digit > 0 && count[digit] < need; digit--) need -= count[digit];
        prefix |= (uint32_t)digit << shift;
        fixed |= (uint32_t)0xff << shift;
    }
    /* prefix is the k-th largest key: every key above it is picked, and the first `need`
     * keys equal to it. */
    int64_t m = 0;
    for (int64_t i = 0; i < n; i++) {
        if (keys[i] > prefix || (keys[i] == prefix && need-- > 0)) {
            idx[m] = (int32_t)i;
            g_at[m] = g[i];
            m++;
        }
    }
    free(keys);
    return m == k ? PC_OK : PC_ERR_INVALID;
}
