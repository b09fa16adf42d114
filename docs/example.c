#include <ape/ape.h>
#include <math.h>
#include <stdio.h>

int main(void)
{
	enum { B = 1, H = 6, HKV = 6, L = 256, D = 64 };
	static float q[B * H * L * D], k[B * HKV * L * D], v[B * HKV * L * D], o[B * H * L * D];
	static float lse[B * H * L];
	ape_context *ctx;
	ape_selection sel;
	ape_attn_desc desc;
	ape_tensor tq, tk, tv, to;
	int err;

	for (int i = 0; i < B * H * L * D; i++) /* any data: here a deterministic pattern */
		q[i] = k[i] = v[i] = sinf(0.37f * (float)i);
	if ((err = ape_context_create(&ctx, NULL)) ||
	    (err = ape_device_select(ctx, "auto", -1, &sel))) {
		fprintf(stderr, "%s: %s\n", ape_err_name(err), ape_last_error());
		return 1;
	}
	ape_attn_desc_init(&desc);   /* plain RoPE attention until parameters are set */
	desc.delta.value = 0.397f;   /* one value for every head ...                  */
	desc.lambda.value = 0.1f;    /* ... or .per_head = an array of H floats        */
	ape_tensor_init(&tq, q, APE_F32, B, H, L, D);
	ape_tensor_init(&tk, k, APE_F32, B, HKV, L, D);
	ape_tensor_init(&tv, v, APE_F32, B, HKV, L, D);
	ape_tensor_init(&to, o, APE_F32, B, H, L, D);
	err = ape_attention_forward(sel.device, &desc, &tq, &tk, &tv, &to, lse, NULL);
	if (err)
		fprintf(stderr, "%s: %s\n", ape_err_name(err), ape_last_error());
	else
		printf("ran on %s: O[0] = %g, LSE[0] = %g\n", sel.note, o[0], lse[0]);
	ape_context_destroy(ctx);
	return err ? 1 : 0;
}
